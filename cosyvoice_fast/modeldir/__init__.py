"""Find, validate and load a model directory (official, fixture or synthetic), and write synthetic ones."""
