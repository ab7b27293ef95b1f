"""Tools around the library, never imported by it: the `hf-specdec` command (`cli.py`), benchmarks (`bench/`),
the demo, the embedded real model pair (`models/`: fetch, verify, convert, load), prompts, calibration plots, and
the `plan`, `calibrate` and `ngram train` commands. Only tools use matplotlib and psutil."""
