"""Getting the harness and its engines onto a node: what the node is (node_profile), and a wheel
folder that installs there without a package index (wheel_folder)."""
