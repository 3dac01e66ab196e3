// How the image is run in production, as one fact for two tests: test/processes/image.test.ts runs the containers
// with these docker flags (and so proves the image works under them), test/processes/deploy.test.ts checks the
// Kubernetes manifests ask for the same.

/** The image's user (deploy/Dockerfile `USER node`; uid of the base image's node user). */
export const RUN_AS_USER = 1000;
/** Writable scratch the worker is given (the Deployment's emptyDir); nothing else is writable. */
export const WORKER_TMP = '/tmp';

/** docker run flags: non-root (the image's USER), read-only root, every capability dropped, no setuid gain. */
export const HARDENED_DOCKER_FLAGS = ['--read-only', '--cap-drop', 'ALL', '--security-opt', 'no-new-privileges'];
/** The worker's writable scratch, a small tmpfs. */
export const WORKER_TMP_FLAGS = ['--tmpfs', `${WORKER_TMP}:size=16m`];
