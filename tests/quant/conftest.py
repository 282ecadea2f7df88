import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are small: on a shared, loaded 2-core box intra-op threading costs far more than it gives."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
