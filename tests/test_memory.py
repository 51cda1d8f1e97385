"""ActivationMeter: bytes autograd saves for backward, counted by storage, released as freed."""

import torch

from tinylm.training.memory import ActivationMeter


def test_counts_saved_bytes_and_releases_them():
    x = torch.randn(100, 50, requires_grad=True)  # 20,000 bytes
    meter = ActivationMeter()
    with meter:
        y = x.exp()  # saves its output: 20,000 bytes
        z = (y * 2).sum()  # multiplying by a Python scalar saves nothing
        assert meter.live_bytes == 20_000  # exp keeps only its result for backward
        z.backward()
    del y, z
    assert meter.peak_bytes >= 20_000
    assert meter.live_bytes == 0


def test_views_of_one_storage_count_once_and_parameters_are_excluded():
    lin = torch.nn.Linear(64, 64, bias=False)  # its weight is saved for backward but is not an activation
    x = torch.randn(8, 64, requires_grad=True)
    meter = ActivationMeter.for_model(lin)
    with meter:
        h = lin(x)  # saves x (2,048 bytes) and the weight (excluded)
        a = h.view(-1)
        out = (a * a).sum() + (h.view(8, 64) * h.view(8, 64)).sum()  # the same storage saved repeatedly
        out.backward()
    assert meter.peak_bytes == x.numel() * 4 + h.numel() * 4


def test_sigmoid_chain_peak_equals_sum_of_outputs():
    x = torch.randn(1000, requires_grad=True)
    meter = ActivationMeter()
    with meter:
        y = x
        for _ in range(5):
            y = torch.sigmoid(y)  # each saves its output, 4,000 bytes
        after_forward = meter.live_bytes
        y.sum().backward()
    assert after_forward == 5 * 4000
    assert meter.peak_bytes == 5 * 4000
