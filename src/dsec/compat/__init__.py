"""Drop-in compatibility layers for other sandbox APIs, built on our public interfaces."""
