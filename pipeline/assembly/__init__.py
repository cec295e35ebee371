"""From the staged blocks to each call's request: the replay walk that shapes, hashes and measures
every request of a thread (`replay`), and the request store that keeps message bodies once
(`store`)."""
