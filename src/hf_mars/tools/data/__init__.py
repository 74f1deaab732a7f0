"""Training data: prompts from sources that are not evaluation sets (`sourcing`), the checks that keep them apart
(`decontamination`), and self-distilled answers (`distillation`)."""
