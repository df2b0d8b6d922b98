"""evaluation: score and generate under a saved checkpoint in one process; loads through checkpoints/, never saves
or steps an optimizer."""
