"""`python -m lowbit ...` is the `lowbit` command."""

import sys

from lowbit.cli import main

sys.exit(main())
