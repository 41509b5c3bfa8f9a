"""nanolab's autograder: hidden tests for each lab and the harness behind `nanolab grade`."""
