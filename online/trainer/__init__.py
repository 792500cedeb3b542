"""Online distillation of model drafters: losses, the training loop, one training round."""
