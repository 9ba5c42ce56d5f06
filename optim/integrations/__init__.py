"""sparsecomm inside other trainers: Hugging Face ``Trainer`` (:mod:`optim.integrations.huggingface`) and
PyTorch Lightning (:mod:`optim.integrations.lightning`). Each module imports its trainer package; the
library itself never does (install the ``trainers`` extra)."""
