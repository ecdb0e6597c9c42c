"""The OpenWebText cleaning pipeline as streaming commands; see README.md here."""
