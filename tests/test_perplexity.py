import math

import torch
import torch.nn.functional as F

from tinylm.config import ModelConfig
from tinylm.constants import IGNORE_INDEX, SOS_ID
from tinylm.evaluation.perplexity import document_windows, evaluate_texts, metrics, score_token_documents
from tinylm.models.gpt import GPT
from tinylm.tokenizers import CharTokenizer


def test_metrics_on_a_hand_checked_case():
    # 4 tokens with NLL 1, 2, 3, 2 nats; text of 6 bytes and 2 words
    m = metrics(8.0, 4, 6, 2)
    assert math.isclose(m["token_ppl"], math.exp(2.0))
    assert math.isclose(m["bpb"], 8.0 / (math.log(2) * 6))
    assert math.isclose(m["word_ppl"], math.exp(4.0))


def test_windows_score_every_token_once_with_full_context():
    ids = list(range(100, 137))  # 37 tokens -> 36 targets, context 8
    seen = []
    for inputs, targets in document_windows(ids, 8, stride=4):
        assert len(inputs) == 8 == len(targets)
        for j, t in enumerate(targets):
            if t != IGNORE_INDEX:
                assert t == inputs[j] + 1  # the target is the token after the input at j
                seen.append(t)
    assert seen == ids[1:]
    # a short document is one window
    assert list(document_windows([1, 2, 3], 8)) == [([1, 2], [2, 3])]


def test_perplexity_equals_exp_mean_token_nll_by_hand():
    torch.manual_seed(0)
    tok = CharTokenizer().train(["abcdefgh ijk"])
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=8, d_model=16, n_layers=1, n_heads=2)).eval()
    texts = ["abc def", "ghij k abc defg hij"]  # the second is longer than the context: windows
    m = evaluate_texts(model, tok, texts, batch_size=2)
    # by hand: each document alone, token by token, with the context the windows give it
    total, count = 0.0, 0
    torch.set_grad_enabled(False)
    for text in texts:
        ids = [SOS_ID, *tok.encode(text)]
        for inputs, targets in document_windows(ids, 8):
            logits, _ = model(torch.tensor([inputs]))
            logp = F.log_softmax(logits[0].double(), -1)
            for j, t in enumerate(targets):
                if t != IGNORE_INDEX:
                    total -= float(logp[j, t])
                    count += 1
    torch.set_grad_enabled(True)
    assert count == m["tokens"] == len("abc def") + len("ghij k abc defg hij")
    assert math.isclose(m["token_ppl"], math.exp(total / count), rel_tol=1e-5)
    assert math.isclose(m["bpb"], total / (math.log(2) * (7 + 19)), rel_tol=1e-5)
    assert math.isclose(m["word_ppl"], math.exp(total / 7), rel_tol=1e-5)


def test_batching_does_not_change_the_score():
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=30, context_length=16, d_model=16, n_layers=1, n_heads=2)).eval()
    docs = [[SOS_ID] + torch.randint(4, 30, (n,)).tolist() for n in (3, 9, 20, 40)]
    a = score_token_documents(model, docs, batch_size=1)
    b = score_token_documents(model, docs, batch_size=4)
    assert a[1] == b[1] == 3 + 9 + 20 + 40
    assert math.isclose(a[0], b[0], rel_tol=1e-5)
