"""One-off research suites: each measured one question about the bundled models, once."""
