from setuptools import find_packages, setup


def read_requirements(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith('#')]


setup(
    name='lmdeploy',
    version='0.1.0',
    description='Serve large language models: an in-tree PyTorch engine, an OpenAI-compatible server, a chat CLI',
    long_description=open('README.md').read(),
    long_description_content_type='text/markdown',
    python_requires='>=3.10',
    packages=find_packages(include=['lmdeploy', 'lmdeploy.*']),
    package_data={'lmdeploy': ['lite/*.txt'], 'lmdeploy.serve.openai': ['static/*'],
                  'lmdeploy.pytorch.kernels.cpu': ['*.cpp', '*.h']},
    install_requires=read_requirements('requirements.txt'),
    extras_require={'test': read_requirements('requirements-test.txt'), 'ray': ['ray>=2.40']},
    entry_points={'console_scripts': ['lmdeploy = lmdeploy.cli.main:entry']},
)
