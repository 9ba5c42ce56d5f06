"""The GPT train job behind ``sparsecomm train``: config, model, data, tasks, and its failure-transparent run."""
