"""Where and how a pass runs: the tree masks a model's attention takes (`attention.py`) and the fixed shapes of its
passes (`pass_shapes.py`), the devices and CPU facts (`devices.py`), tensor-parallel ranks (`ranks.py`), host copies
made once (`device_copies.py`), compiled calls (`faster_call.py`), what a model is (`model_info.py`), and the cache
folder and its JSON files (`paths.py`). Below the stages, above the contracts."""
