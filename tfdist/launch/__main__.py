from tfdist.launch.main import run

run()
