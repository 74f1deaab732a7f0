"""`hf-mars recipe`: the shipped checkpoint's recipe as steps (`steps`) and their settings (`settings`)."""
