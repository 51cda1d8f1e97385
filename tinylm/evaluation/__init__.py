"""Evaluation: perplexity per token / per word, bits per byte."""

from tinylm.evaluation.perplexity import evaluate_split, evaluate_texts, metrics, score_token_documents

__all__ = ["evaluate_split", "evaluate_texts", "metrics", "score_token_documents"]
