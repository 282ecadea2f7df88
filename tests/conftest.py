"""Suite-wide setup. On a machine without CUDA, Triton kernels run in its interpreter, and triton must be imported
in interpreter mode before anything else imports it (see k3c/codegen/triton_mode.py)."""
import torch

if not torch.cuda.is_available():
    from k3c.codegen.triton_mode import prepare_interpreter

    prepare_interpreter()
