"""`tinylm serve`: one model or several behind an OpenAI-compatible HTTP API and a playground page.

engine.py runs the models in an engine process of their own (or in this one) and carries rows,
calls and events between the two; scheduler.py decodes every concurrent request in one batch
(rows join and leave between steps); models.py holds what a served model answers besides
completions (card, tokens, scores, attention); completions.py a completion request from its
check to its response; schemas.py the request bodies; state.py what the routes share and the
dependency that hands it to them; app.py the FastAPI routes and OpenAI's error shape, and
lens.py, compare.py, runs.py the playground's own routes; static/ the page, plain HTML/JS/CSS.
"""
