import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in its interpreter (tests/ops/test_triton_attn.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
