"""Training the new parameters of a linearized model."""
