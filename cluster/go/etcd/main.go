// etcd's own entry point (what go.etcd.io/etcd/v3's main calls), as one binary.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
