"""Byte stores: where checkpoint and output bytes live, and the one way to read and write them."""
