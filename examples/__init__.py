"""Examples of a user's own model and data trained by the launcher (``model=custom``, ``data=custom``)."""
