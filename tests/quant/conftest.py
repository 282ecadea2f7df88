import pytest


@pytest.fixture(autouse=True)
def _single_threaded(one_thread):
    """These tensors are small: intra-op threading costs far more than it gives."""
    yield
