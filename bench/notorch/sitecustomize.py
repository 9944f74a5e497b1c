"""Put `bench/notorch` first on PYTHONPATH and `import torch` fails at once, as on a node
without torch: ckptd then takes DeepSpeed world sizes from its config (`world_size`)."""

import sys

sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ModuleNotFoundError
