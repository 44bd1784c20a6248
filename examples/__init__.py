"""Examples: run configurations and a model of your own (`custom_model.py`)."""
