"""Trainer callbacks that run memcheck's pre-flight check before step 1 (transformers, Lightning)."""
