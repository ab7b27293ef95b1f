"""Studies: one program per measurement behind a figure in the docs (kernels, draft costs, engine overhead, batches,
GPU sessions), each run as `python -m hf_specdec_tools.bench.studies.<name> --help`; `hf-specdec bench` (the package
beside this one) is the everyday benchmark. Results go under `benchmarks/results/<machine>/`; what each program
measures: docs/benchmarks.md."""
