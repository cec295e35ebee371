"""Files ctxreplay reads at run time, shipped inside the package as `ctxreplay.data`: the o200k_base
tokenizer (tokenizer/) and the preset pipelines (pipelines/). Read them through importlib.resources;
data/samples/ is the repository's own sample input and is not installed."""
