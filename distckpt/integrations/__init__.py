"""Framework integrations (Hugging Face, Accelerate, Lightning): optional extras, each imported only when used."""
