"""One scenario on one rank (task): the seeded model zoo (models), data (data) and optimizers (optim)."""
