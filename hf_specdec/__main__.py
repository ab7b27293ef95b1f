import sys

from hf_specdec_tools.cli import main

sys.exit(main())
