"""The logit lens: its last row is the model's own prediction, its first the embeddings read out
directly, and a model without layers is refused by name."""

import pytest
import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.evaluation.lens import logit_lens
from tinylm.models.bigram import NeuralBigramLM
from tinylm.models.gpt import GPT

SHAPES = {
    "gpt2": {},
    "llama": {"positions": "rope", "norm": "rmsnorm", "ffn": "swiglu", "bias": False, "n_kv_heads": 2},
    "capped": {"logit_softcap": 5.0, "qk_norm": True, "tie_weights": False},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_last_row_is_the_models_prediction(shape):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layers=3, n_heads=4, **SHAPES[shape]))
    torch.nn.init.normal_(model.lm_head.weight, std=0.5)  # confident predictions: distinct top tokens
    ids = torch.randint(0, 50, (12,)).tolist()
    grid = logit_lens(model.train(), ids, top=5)  # the lens evaluates without dropout, then hands the mode back
    assert model.training
    with torch.inference_mode():
        logits, _ = model.eval()(torch.tensor([ids]))
    assert grid.layers == ["embeddings", "layer 1", "layer 2", "layer 3"]
    assert grid.logits.shape == (4, 12, 50)
    torch.testing.assert_close(grid.logits[-1], logits[0], rtol=0, atol=1e-6)
    probs = torch.softmax(logits[0], dim=-1)
    values, top = probs.topk(5, dim=-1)
    assert grid.top_ids[-1] == top.tolist()
    torch.testing.assert_close(torch.tensor(grid.top_probs[-1]), values, rtol=0, atol=1e-6)
    expected_next = probs[torch.arange(11), torch.tensor(ids[1:])]
    assert grid.next_probs[-1][-1] is None
    torch.testing.assert_close(torch.tensor(grid.next_probs[-1][:-1]), expected_next, rtol=0, atol=1e-6)
    # every row is a distribution read out by the same head: the top-5 probabilities sum below 1
    assert all(0 < sum(cell) <= 1 + 1e-6 for row in grid.top_probs for cell in row)


def test_the_first_row_reads_the_embeddings():
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=30, context_length=8, d_model=16, n_layers=2, n_heads=2)).eval()
    ids = [3, 7, 7, 1]
    grid = logit_lens(model, ids, top=1)
    with torch.inference_mode():
        stream = model.tok_emb(torch.tensor([ids])) + model.pos_emb.weight[:4][None]
        expected = model.lm_head(model.norm_f(stream))[0]
    torch.testing.assert_close(grid.logits[0], expected, rtol=0, atol=1e-6)
    assert grid.top_ids[0] == expected.argmax(-1)[:, None].tolist()


def test_bad_input_is_refused_by_name():
    model = GPT(ModelConfig(vocab_size=30, context_length=8, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(TinyLMError, match="context of 8"):
        logit_lens(model, list(range(9)))
    with pytest.raises(TinyLMError, match="at least one token"):
        logit_lens(model, [])
    with pytest.raises(TinyLMError, match="top must be"):
        logit_lens(model, [1, 2], top=0)
    with pytest.raises(TinyLMError, match="NeuralBigramLM, which has none"):
        logit_lens(NeuralBigramLM(30, 8), [1, 2])
