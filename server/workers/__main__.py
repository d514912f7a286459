import sys

if len(sys.argv) > 1 and sys.argv[1].startswith("-"):  # --listen ADDRESS ...: see listen.py
    from .listen import main as listen

    listen(sys.argv[1:])
else:
    from .main import main

    main()
