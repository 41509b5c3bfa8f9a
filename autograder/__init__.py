"""nanolab's autograder: hidden tests for each lab and the harness behind `nanolab grade`.

Hidden tests use `autograder.testing` only. To add a lab, follow "Adding a lab" in
``autograder/README.md``: it names every place a lab plugs in.
"""
