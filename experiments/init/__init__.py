"""Starts from pretrained weights (SVD, CoLA, whitened) and low-rank fine-tuning and pretraining on real text."""
