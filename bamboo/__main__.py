from bamboo.cli import main
import sys
sys.exit(main())
