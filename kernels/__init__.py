"""The CUDA sources: one `.cu` per pass, device helpers in headers by role; package data that build reads."""
