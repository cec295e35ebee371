"""Regression on assembled outputs: goldens written by `snapshot`, set against a fresh replay by
`diff`, and the pytest plug-in (`pytest_plugin`) that does both inside a test."""
