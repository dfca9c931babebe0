"""The real world: kernel backends, the paged decoder, the executor, profiling and validation.

torch_npu registers itself as an autoloaded torch backend; on a machine with the wheel but no
CANN toolkit a bare ``import torch`` then fails. Setting ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
before torch is first imported keeps torch importable everywhere; the npu backend imports
torch_npu explicitly when it is asked for (see ``realexec/backends/npu.py``).
"""

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
