"""The capture: how a module's forward becomes timed rows (Dynamo by default, the torch.fx ladder, compiled models, module hooks), and which timer times it."""
