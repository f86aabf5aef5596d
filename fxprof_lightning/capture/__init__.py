"""The capture: how a module's forward becomes timed rows (Dynamo by default, compiled models, module hooks where Dynamo cannot be used), and which timer times it."""
