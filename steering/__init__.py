"""ds4 subpackage."""
