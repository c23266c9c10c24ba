"""What the user names, turned into a model and its worst-case batch: a model file
(``source``) or a transformers config (``hf``)."""
