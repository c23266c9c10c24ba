"""Results: frozen dataclasses of integer bytes (``results``), every table and the JSON
(``text``), and the busiest GPU's memory event by event (``timeline``)."""
