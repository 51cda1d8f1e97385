"""`tinylm serve`: one model or several behind an OpenAI-compatible HTTP API and a playground page.

scheduler.py decodes every concurrent request in one batch (rows join and leave between steps);
models.py holds what a served model answers besides completions (card, tokens, scores,
attention); schemas.py the request bodies; app.py the FastAPI routes and OpenAI's error shape;
static/ the page, plain HTML/JS/CSS.
"""
