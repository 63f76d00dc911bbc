"""What torchtitan's cross-entropy keeps for its backward, eager and under ``torch.compile``, against the memory
model's bytes per logit element (``pipesched.optimizer.cost.memory.CROSS_ENTROPY_BYTES``, "fp32" and "compiled").

The loss is torchtitan's ``cross_entropy_loss`` (``torchtitan/components/loss.py``: ``F.cross_entropy`` on
``pred.flatten(0, 1).float()``), run on bf16 logits out of a matrix multiply as the LM head gives them; every
tensor autograd saves is caught with ``torch.autograd.graph.saved_tensors_hooks`` and counted once per storage.
Eager PyTorch saves log-softmax's fp32 output (4 B a logit); compiled, Inductor's partitioner saves the bf16 logits
and two fp32 numbers a row and recomputes the log-softmax in the backward (2 B a logit), and the backward gives the
logits' gradient in bf16 (2 B a logit: the "compiled" transient).
"""

from __future__ import annotations

from typing import Any

import pytest

from pipesched.optimizer.cost.memory import CROSS_ENTROPY_BYTES

torch = pytest.importorskip("torch")

BATCH, SEQUENCE, HIDDEN, VOCAB = 2, 128, 32, 2048


def cross_entropy_loss(pred: Any, labels: Any) -> Any:
    """torchtitan's loss (``torchtitan/components/loss.py`` at e7c0cae)."""
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def saved_bytes_per_logit(loss_fn: Any) -> tuple[float, Any, Any]:
    """(bytes saved for the backward per logit element, the loss, the logits' gradient)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(BATCH, SEQUENCE, HIDDEN, generator=generator).to(torch.bfloat16)
    head = torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
    pred = inputs @ head.t()
    pred.retain_grad()
    storages: dict[int, int] = {}

    def pack(tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_fn(pred, labels)
    loss.backward()
    return sum(storages.values()) / (BATCH * SEQUENCE * VOCAB), loss.detach(), pred.grad


@pytest.mark.slow
def test_a_compiled_loss_saves_the_bf16_logits_not_the_fp32_log_softmax() -> None:
    eager_bytes, eager_loss, eager_grad = saved_bytes_per_logit(cross_entropy_loss)
    compiled_bytes, compiled_loss, compiled_grad = saved_bytes_per_logit(torch.compile(cross_entropy_loss))
    assert torch.allclose(eager_loss, compiled_loss, rtol=1e-4)
    assert torch.allclose(eager_grad.float(), compiled_grad.float(), rtol=1e-2, atol=1e-6)
    rows = 2 * (2 * 4 + 8) / VOCAB  # twice two fp32 numbers and an int64 label a row, per logit of the row
    assert eager_bytes == pytest.approx(CROSS_ENTROPY_BYTES["fp32"][0], abs=rows)
    assert compiled_bytes == pytest.approx(CROSS_ENTROPY_BYTES["compiled"][0], abs=rows)
    assert compiled_grad.dtype == torch.bfloat16  # the backward's one allocation: 2 B a logit
    assert compiled_grad.element_size() == CROSS_ENTROPY_BYTES["compiled"][1]
