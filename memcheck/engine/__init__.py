"""The entry points, each a pipeline over the layers below: ``estimate`` (one job traced),
``compare`` (every strategy side by side), ``plan`` (the settings that fit) and
``preflight`` (a job judged against its capacity, with its fix)."""
