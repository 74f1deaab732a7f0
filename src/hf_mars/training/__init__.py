"""Training MARS models: `MARSTrainer` (a thin TRL `SFTTrainer` subclass), its attention masks, the train script."""
