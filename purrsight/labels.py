"""What the data's labels mean to the loss: shared by the data (which makes labels) and the model (which scores them)."""

IGNORE_INDEX = -100  # the label value torch's cross-entropy skips: prompt and padding positions
