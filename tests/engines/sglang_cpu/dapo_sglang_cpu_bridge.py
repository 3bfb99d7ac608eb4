"""Loaded at start-up (a .pth line) in SGLang's CPU test environment only; see docs/engines.md.

1. torchvision 0.28 from the index is CUDA-linked: its ops fail to register beside the CPU torch and its
   fake-op registrations then raise at import ("operator torchvision::nms does not exist"). SGLang imports
   torchvision even for text models; an empty stand-in for `torchvision._meta_registrations` lets the import
   finish (no torchvision op is used).
2. SGLANG_USE_CPU_ENGINE=1: without it device="cpu" takes the GPU path.
3. The stand-in `sgl_kernel` (stubs/) goes on the path.
"""

import os
import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
_STUBS = os.environ.get("DAPO_SGLANG_STUBS")
if _STUBS and _STUBS not in sys.path:
    sys.path.append(_STUBS)
